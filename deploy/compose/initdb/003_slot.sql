-- `outbox-relay setup` output for the default names (table public.outbox,
-- publication and slot outbox_relay, role outbox_relay): sql/003_slot.sql rendered,
-- for docker-compose.yml, whose postgres runs it on its first start
-- (/docker-entrypoint-initdb.d). Do not edit by hand: a test keeps what
-- follows this comment block equal to the relay's rendering, which
-- `outbox-relay --config deploy/compose/relay.toml setup` prints.

-- outbox-relay 003: the logical replication slot (plugin pgoutput). Created
-- after the publication, in its own transaction. It holds WAL from now on:
-- run the relay, or drop the slot (SELECT pg_drop_replication_slot(...)).
SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')
WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'outbox_relay');
