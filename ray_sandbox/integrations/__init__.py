"""Backends for agent and RL frameworks' own sandbox interfaces (docs/integrations.md).

One module per framework, each imported by its user (none is imported here, so each pulls
only its own framework): ``minisweagent``, ``uni_agent``, ``rllm``, ``tinker_cookbook``,
``open_instruct`` and ``skyrl`` (Harbor's trial config). Every adapter speaks to one
:class:`~ray_sandbox.integrations._box.Box`, a sandbox made through Ray
(``ray_sandbox.create``) or through the HTTP service (``ray_sandbox.client``), chosen by the
adapter's ``service_url`` option or ``$RAY_SANDBOX_URL``.
"""
