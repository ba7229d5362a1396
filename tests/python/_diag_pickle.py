import sys, os
sys.path.insert(0, sys.argv[1])
def step(m): print("STEP", m, flush=True)
step("import moelink"); import moelink; print(moelink.__file__, flush=True)
if len(sys.argv) > 2 and sys.argv[2] == "torch":
    step("import torch"); import torch
print("modules:", sorted(m for m in sys.modules if "." not in m), flush=True)
import pickle, copy
if "throw" in sys.argv:
    step("throw")
    try:
        moelink.Config(max_num_tokens=0).validate()
    except ValueError as e:
        print("caught", e, flush=True)
step("Config()"); c = moelink.Config(max_num_tokens=128, num_experts=256, experts_per_token=8,
                   hidden_dim=7168, hidden_dim_scale=56, in_dtype="fp8", out_dtype="bf16",
                   rank=1, world_size=8, dp_size=2)
step("repr"); print(repr(c), flush=True)
step("eq self"); print(c == c, flush=True)
step("getstate"); s = c.__getstate__(); print(s, flush=True)
step("reduce_ex"); print(c.__reduce_ex__(4), flush=True)
step("dumps"); b = pickle.dumps(c)
step("loads"); d = pickle.loads(b)
step("repr d"); print(repr(d), flush=True)
step("eq d"); print(d == c, flush=True)
step("copy"); print(copy.copy(c) == c, flush=True)
step("TcpBootstrap"); bs = moelink.TcpBootstrap(0, 1, "127.0.0.1", 29533, 5.0)
step("done")
