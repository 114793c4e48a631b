"""The jail's entry point, mounted as `/sandbox/zygote.py` (see `sandbox_worker/limits.py`).

The package itself is mounted at `/sandbox/inside`; the interpreter runs with -P, which keeps the
script's folder off `sys.path`, so put `/sandbox` there and start the zygote. The one argument is
the jail's settings (`inside.settings.JailSettings`, JSON).
"""

import sys

if __name__ == "__main__":
    sys.path.insert(0, "/sandbox")
    from inside.zygote import main

    main()
