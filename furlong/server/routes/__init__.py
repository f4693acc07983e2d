"""The HTTP routes of ``furlong serve``, one module per concern, each a module-level
``APIRouter`` that ``app.create_app`` mounts under ``/api/v1``:

- ``handshake``: health, capabilities, the SDK's client config and telemetry, ``auth/token``;
- ``sessions``: client sessions and their heartbeats;
- ``training``: models, ``forward_backward`` and ``optim_step``;
- ``sampling``: sampling sessions and ``asample``;
- ``futures``: ``retrieve_future``;
- ``checkpoints``: save, load, copy and delete checkpoints, their TTLs and info;
- ``exports``: external weights and snapshot archives, and the downloads their URLs name;
- ``listings``: the paged lists of sessions, runs and checkpoints.

What they share (the caller's identity, the service, bodies, errors) is in ``deps``,
``bodies`` and ``errors``.
"""

PREFIX = "/api/v1"  # where create_app mounts every router (the download URLs handed out name it)
