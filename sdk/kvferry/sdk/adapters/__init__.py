"""Framework adapters: keep a kvferry conversation alive while an agent framework runs its tools.

Each module needs its framework, installed by the SDK's extra of the same name (none is imported by
``kvferry.sdk``)::

    pip install 'kvferry-sdk[langchain]'       # kvferry.sdk.adapters.langchain
    pip install 'kvferry-sdk[openai-agents]'   # kvferry.sdk.adapters.openai_agents
"""
