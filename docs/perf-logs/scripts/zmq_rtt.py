"""Exploratory (dev VM): round trip of a 64-byte message between a DEALER here and a ROUTER
echo in a second process, pyzmq on loopback, p50 over 1800 round trips after 200 of
warm-up: the floor under pdkv's control round trips. Produced ../devvm-zmq-rtt-s2.log.
    python docs/perf-logs/scripts/zmq_rtt.py"""
import multiprocessing as mp
import statistics
import time

import zmq


def server(q):
    s = zmq.Context().socket(zmq.ROUTER)
    s.bind("tcp://127.0.0.1:0")
    q.put(s.getsockopt(zmq.LAST_ENDPOINT).decode())
    while True:
        f = s.recv_multipart()
        if f[1] == b"q":
            break
        s.send_multipart(f)


if __name__ == "__main__":
    q = mp.Queue()
    p = mp.Process(target=server, args=(q,))
    p.start()
    s = zmq.Context().socket(zmq.DEALER)
    s.connect(q.get(timeout=10))
    lat = []
    for _ in range(2000):
        t = time.perf_counter()
        s.send(b"x" * 64)
        s.recv()
        lat.append(time.perf_counter() - t)
    print(f"DEALER/ROUTER round trip p50 {statistics.median(lat[200:]) * 1e6:.0f} us")
    s.send(b"q")
    p.join(10)
