"""vLLM general plugin (entry point ``vllm.general_plugins: ds4lab``). Filled in by the plugin issue."""


def register() -> None:
    return None
