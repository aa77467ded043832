-- `outbox-relay setup` output for the default names (table public.outbox,
-- publication and slot outbox_relay, role outbox_relay): sql/004_role.sql rendered,
-- for docker-compose.yml, whose postgres runs it on its first start
-- (/docker-entrypoint-initdb.d). Do not edit by hand: a test keeps what
-- follows this comment block equal to the relay's rendering, which
-- `outbox-relay --config deploy/compose/relay.toml setup` prints.

-- outbox-relay 004: a least-privilege role for the relay: it may stream
-- (REPLICATION) and read and manage the outbox table's rows, nothing else.
-- Set its password yourself, e.g. in psql: \password outbox_relay
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'outbox_relay') THEN
        CREATE ROLE outbox_relay WITH LOGIN REPLICATION;
    END IF;
EXCEPTION WHEN duplicate_object THEN
    NULL; -- created meanwhile by a concurrent setup (roles are cluster-wide)
END
$$;
GRANT USAGE ON SCHEMA public TO outbox_relay;
GRANT SELECT, UPDATE, DELETE ON public.outbox TO outbox_relay;
