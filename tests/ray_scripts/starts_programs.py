"""A program this script starts is not this script: it gets `ray` as without `ddptrain run`
(here the real one is installed), in its own trainers' workers too."""

import os
import subprocess
import sys

import ray.train

OTHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "other_program.py")

print("script's ray.train:", ray.train.__name__, flush=True)
proc = subprocess.run([sys.executable, OTHER], capture_output=True, text=True, timeout=180)
print(proc.stdout, end="", flush=True)
print(proc.stderr[-3000:], file=sys.stderr)
sys.exit(proc.returncode)
