-- outbox-relay 003: the logical replication slot (plugin pgoutput), created with
-- failover = true (postgres.failover_slot; PostgreSQL 17 or later): a standby with
-- sync_replication_slots = on keeps a copy, usable once it is promoted. Created
-- after the publication, in its own transaction. It holds WAL from now on: run
-- the relay, or drop the slot (SELECT pg_drop_replication_slot(...)).
SELECT pg_create_logical_replication_slot({{'slot'}}, 'pgoutput', false, false, true)
WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = {{'slot'}});
