-- outbox-relay 004 for Amazon RDS and Aurora PostgreSQL (`setup --platform
-- rds` or `aurora`, or detected from the roles rds_superuser and
-- rds_replication): the least-privilege role of 004_role.sql, run as the
-- master user. RDS keeps the REPLICATION attribute to itself (CREATE ROLE ...
-- REPLICATION is refused); the privilege to create slots and to stream is
-- membership in rds_replication, which members of rds_superuser may grant.
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
GRANT rds_replication TO {{role}};
GRANT USAGE ON SCHEMA {{schema}} TO {{role}};
GRANT SELECT, UPDATE, DELETE ON {{schema}}.{{table}} TO {{role}};
