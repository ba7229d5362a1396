"""python -m moelink.serve --model DIR: serves the model over HTTP."""

from __future__ import annotations

import argparse
import sys

from .server import Server, ServerOptions, add_model_arguments, model_options, set_switch_interval


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="moelink-serve", description=__doc__)
    p.add_argument("--model", required=True, help="model directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", default="cpu", help="the model's backend: cpu (host loops), or nvlink (the GPU path)")
    p.add_argument("--num-pages", type=int, default=256, help="KV-cache pages per layer")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=8, help="requests a step carries at most")
    p.add_argument("--token-budget", type=int, default=256, help="query tokens a step carries at most")
    p.add_argument("--max-model-len", type=int, default=1024, help="prompt plus output tokens at most")
    p.add_argument("--served-model-name", default=None)
    add_model_arguments(p)
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="never share KV pages between requests (the prefix cache's baseline)")
    p.add_argument("--speculative", action="store_true",
                   help="speculative decoding on the checkpoint's MTP module (the same tokens, up to two a step)")
    p.add_argument("--engines", type=int, default=0,
                   help="start moelink-scheduler and this many engine workers behind the front "
                        "(0: one engine in this process)")
    p.add_argument("--pd", action="store_true",
                   help="with --engines N: prefill/decode disaggregation (the first half prefill workers, "
                        "the rest decode workers; KV moved over the TransferEngine)")
    p.add_argument("--kv-provider", default="auto",
                   help="with --pd: libfabric provider of the KV hand-off (tcp, shm, ...; auto: shm for the "
                        "GPU path's cache, tcp for the CPU path's)")
    p.add_argument("--scheduler", default=None,
                   help="send requests to a running moelink-scheduler at HOST:PORT instead")
    a = p.parse_args(argv)
    set_switch_interval()
    opts = ServerOptions(num_pages=a.num_pages, page_size=a.page_size, max_running=a.max_running,
                         token_budget=a.token_budget, max_model_len=a.max_model_len,
                         backend=a.backend, served_model_name=a.served_model_name,
                         speculative=a.speculative, prefix_caching=not a.no_prefix_caching,
                         kv_provider=a.kv_provider, **model_options(a))
    if a.engines > 0:
        from .cluster import LocalServing
        server = LocalServing(a.model, a.engines, opts, pd=a.pd)
        host, port = server.start(a.host, a.port)
        waiter = server.front
        print(f"moelink-serve: {a.engines} engines behind moelink-scheduler at {server.scheduler.target}",
              flush=True)
    else:
        server = waiter = Server(a.model, opts, scheduler=a.scheduler)
        host, port = server.start(a.host, a.port)
    print(f"moelink-serve: {waiter.model_name} on http://{host}:{port}/v1", flush=True)
    try:
        waiter.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
