"""Agent programs as environments (``agent:module:function``): a program that talks to
an OpenAI-compatible endpoint is branched call by call (``train.envs.agent.program``);
``wire`` is the chat-completions format and ``http`` the loopback server both this and
``rtrees serve`` use."""
