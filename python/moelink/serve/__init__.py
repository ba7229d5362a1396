"""moelink.serve: an OpenAI-compatible HTTP front over moelink.Engine
(docs/serve.md): /v1/completions, /v1/chat/completions (streaming or not),
/v1/models, /health, /metrics.

    python -m moelink.serve --model DIR [--port 8000] [--backend cpu]

The model directory holds config.json, the safetensors checkpoint and
tokenizer.json (Hugging Face `tokenizers`); tokenizer_config.json's
chat_template (jinja2) serves chat requests."""

from .server import Server, ServerOptions

__all__ = ["Server", "ServerOptions"]
