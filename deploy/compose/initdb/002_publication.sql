-- `outbox-relay setup` output for the default names (table public.outbox,
-- publication and slot outbox_relay, role outbox_relay): sql/002_publication.sql rendered,
-- for docker-compose.yml, whose postgres runs it on its first start
-- (/docker-entrypoint-initdb.d). Do not edit by hand: a test keeps what
-- follows this comment block equal to the relay's rendering, which
-- `outbox-relay --config deploy/compose/relay.toml setup` prints.

-- outbox-relay 002: the publication. Inserts only: the relay's own updates
-- (marking rows published) and deletes (retention) never reach the stream.
-- publish_via_partition_root: a partitioned outbox streams as one table.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = 'outbox_relay') THEN
        CREATE PUBLICATION outbox_relay FOR TABLE public.outbox
            WITH (publish = 'insert', publish_via_partition_root = true);
    END IF;
END
$$;
