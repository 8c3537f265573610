"""Sessions and their one owner, the session manager: registry per tenant, residency, checkpoints, admission,
snapshot codec and store I/O, prefix index, leases; Session and TenantSessions are handles on it."""
