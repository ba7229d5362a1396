import sys; sys.path.insert(0, sys.argv[1]); rank = int(sys.argv[2]); port = int(sys.argv[3])
import moelink
bs = moelink.TcpBootstrap(rank, 2, "127.0.0.1", port, 30.0)
print("rank", rank, "bootstrap ok", flush=True)
cfg = moelink.Config(max_num_tokens=24, num_experts=8, experts_per_token=3, hidden_dim=32,
                     out_dtype="bfloat16", in_dtype="bfloat16", rank=rank, world_size=2)
a = moelink.AllToAll(cfg, backend="cpu", bootstrap=bs, timeout_s=20.0)
print("rank", rank, "created", a.buffer_bytes, flush=True)
print(a.config == cfg, flush=True)
a.close()
print("rank", rank, "done", flush=True)
