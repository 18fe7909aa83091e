"""many_small.py with decode's reply batching on (B) or off (A: one Outcome, and since
ReserveBatch one GrantMsg, per request), alternated A B A B ... in fresh processes. The
logged A/B (devvm-many-small-s4-outcome-batch-ab.log) predates ReserveBatch: then A
switched off outcome batching only.
python docs/perf-logs/scripts/many_small_ab.py [N] [rounds]"""
import subprocess, sys

N = sys.argv[1] if len(sys.argv) > 1 else "256"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
code = ("import contextlib, runpy, sys; from pdkv.transfer import DecodeReceiver; "
        "DecodeReceiver._replies_together = lambda self: contextlib.nullcontext(); "
        f"sys.argv = ['many_small.py', '{N}']; runpy.run_path('docs/perf-logs/scripts/many_small.py', run_name='__main__')")
for r in range(rounds):
    for name, argv in (("A one Outcome each", [sys.executable, "-c", code]),
                       ("B OutcomeBatch", [sys.executable, "docs/perf-logs/scripts/many_small.py", N])):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        for line in out.stdout.strip().splitlines():
            print(f"{name}: {line}", flush=True)
        if out.returncode:
            print(out.stderr[-2000:])
