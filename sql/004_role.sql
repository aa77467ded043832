-- outbox-relay 004: a least-privilege role for the relay: it may stream
-- (REPLICATION) and read and manage the outbox table's rows, nothing else.
-- Set its password yourself, e.g. in psql: \password outbox_relay
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {{'role'}}) THEN
        CREATE ROLE {{role}} WITH LOGIN REPLICATION;
    END IF;
EXCEPTION WHEN duplicate_object THEN
    NULL; -- created meanwhile by a concurrent setup (roles are cluster-wide)
END
$$;
GRANT USAGE ON SCHEMA {{schema}} TO {{role}};
GRANT SELECT, UPDATE, DELETE ON {{schema}}.{{table}} TO {{role}};
