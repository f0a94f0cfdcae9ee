"""A Chainlit chat page in front of the running app (`make chat`, `serve-app chat`).

The page talks to the app like any client, through the OpenAI client over HTTP, so it runs in
its own environment (.venv-chat: Chainlit pins its own web stack) and imports nothing of the
serving path: `turn` is plain Python, `page` is the Chainlit script.
"""
