"""The service room: the daemon process (config, sockets, sessions, production, plan cache,
shared-memory rings, read-ahead) and its systemd and Prometheus plumbing."""
