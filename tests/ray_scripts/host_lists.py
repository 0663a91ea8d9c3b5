"""Under `ddptrain run --hosts FILE`, the script's trainers and those of the processes
multiprocessing starts from it use FILE; a program the script starts does not (it has
`DDPTRAIN_HOSTFILE` only if the user set it)."""

import multiprocessing
import os
import subprocess
import sys

from host_list_program import trainer_hosts

if __name__ == "__main__":
    print("script's trainers:", trainer_hosts(), flush=True)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print("spawn child's trainers:", pool.apply(trainer_hosts), flush=True)
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_list_program.py")
    proc = subprocess.run([sys.executable, program], capture_output=True, text=True, timeout=120)
    print(proc.stdout, end="", flush=True)
    print(proc.stderr[-3000:], file=sys.stderr)
    sys.exit(proc.returncode)
