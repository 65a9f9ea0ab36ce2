"""atskv inside vLLM (`pip install 'atskv[vllm]'`): a plugin that registers atskv's attention
backend under vLLM's CUSTOM slot. vLLM calls `register` in each of its processes (the
`vllm.general_plugins` entry point); select it with `attention_backend="CUSTOM"`, give vLLM atskv's
worker (`worker_cls="atskv.runtime.vllm.worker.AtskvWorker"`: prompt lengths, freed blocks) and
configure it with `additional_config={"atskv": {...}}` (`atskv.runtime.vllm.config.PluginConfig`)."""

BACKEND = "atskv.runtime.vllm.backend.AtskvAttentionBackend"


def register() -> None:
    """Registers the backend's class path; nothing heavier is imported until vLLM asks for it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
