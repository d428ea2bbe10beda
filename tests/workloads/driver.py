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
        out = {}
        if req.get("thread"):
            t = threading.Thread(target=lambda: out.update(result=fn(*args)))
            t.start()
            t.join()
        else:
            out["result"] = fn(*args)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
