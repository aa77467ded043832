-- Not `outbox-relay setup` output: the demo stack's password for the relay's
-- role (004_role.sql creates it without one). deploy/compose/relay.toml
-- connects with it. Never use this password outside the local demo.
ALTER ROLE outbox_relay WITH PASSWORD 'outbox_relay';
