"""A target process for the tests: loads a workload library and runs calls sent on stdin.

Protocol: one JSON object per line in, one per line out.
  {"call": NAME, "args": [...], "thread": false}  ->  {"result": N}
Pointers stay allocated until the process exits (closing stdin ends it).
"""

import ctypes
import json
import sys
import threading


def main() -> None:
    lib = ctypes.CDLL(sys.argv[1])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        fn = getattr(lib, req["call"])
        fn.restype = ctypes.c_size_t
        args = [ctypes.c_size_t(a) if a >= 0 else ctypes.c_int(a) for a in req.get("args", [])]
        out: dict = {}

        def run(fn=fn, args=args, out=out) -> None:
            out["result"] = fn(*args)

        if req.get("thread"):
            t = threading.Thread(target=run)
            t.start()
            t.join()
        else:
            run()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
