import os
import sys

# Allow running the tests against a plain CMake build of the module without
# installing it: MOELINK_PYTHONPATH=build-py/dev/python pytest tests/python
_extra = os.environ.get("MOELINK_PYTHONPATH")
if _extra:
    for p in reversed(_extra.split(os.pathsep)):
        if p and p not in sys.path:
            sys.path.insert(0, os.path.abspath(p))
