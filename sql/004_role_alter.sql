-- outbox-relay 004 for Google Cloud SQL, Azure Database for PostgreSQL
-- flexible server, Supabase and Neon (`setup --platform cloud-sql`, `azure`,
-- `supabase` or `neon`, or detected from their admin roles): the
-- least-privilege role of 004_role.sql, run as the service's admin role.
-- Their documentation gives a role the REPLICATION attribute with ALTER ROLE
-- ... WITH REPLICATION, run by the admin role, once the role exists; it runs
-- only when the role lacks the attribute, so a role made elsewhere (Neon's
-- Console) is left as it is.
-- Set its password yourself, e.g. in psql: \password outbox_relay
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = {{'role'}}) THEN
        CREATE ROLE {{role}} WITH LOGIN;
    END IF;
EXCEPTION WHEN duplicate_object THEN
    NULL; -- created meanwhile by a concurrent setup (roles are cluster-wide)
END
$$;
DO $$
BEGIN
    IF NOT (SELECT rolreplication FROM pg_roles WHERE rolname = {{'role'}}) THEN
        ALTER ROLE {{role}} WITH REPLICATION;
    END IF;
END
$$;
GRANT USAGE ON SCHEMA {{schema}} TO {{role}};
GRANT SELECT, UPDATE, DELETE ON {{schema}}.{{table}} TO {{role}};
