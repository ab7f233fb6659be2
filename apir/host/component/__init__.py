"""virglrenderer's APIR component: one `HostContext` per guest context (resources,
configuration, HandShake / LoadLibrary / Forward, the reply notification) and the command
trace."""
