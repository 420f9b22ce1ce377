"""Agents written against the OpenAI API, trained through the native engine.

- `server.py` (`Endpoint`): `/v1/chat/completions` and `/v1/completions` on localhost (aiohttp,
  the [agents] extra); `inprocess.py` (`InProcessClient`): the same calls without HTTP.
- `chat.py` (`ChatService`): the calls themselves: the chat template, sampling, stop strings, tool
  calls, token-exact continuation of a session's earlier calls; `requests.py`: request checking.
- `session.py` (`Session`): what a session's calls fed and sampled, as training rows.
- `tool_calls.py`: tool calls in the model family's own format (Qwen `<tool_call>`, Llama 3.1 JSON).
- `tools.py`: example tools (calculator, sandboxed Python); `environment.py`: gym-style environments.

The workflow that runs agents is `areal_jax/workflows/agent.py` (`AgentWorkflow`).
"""
