-- `outbox-relay setup` output for the default names (table public.outbox,
-- publication and slot outbox_relay, role outbox_relay): sql/005_dead_letter.sql rendered,
-- for docker-compose.yml, whose postgres runs it on its first start
-- (/docker-entrypoint-initdb.d). Do not edit by hand: a test keeps what
-- follows this comment block equal to the relay's rendering, which
-- `outbox-relay --config deploy/compose/relay.toml setup` prints.

-- outbox-relay 005: where rejected events are recorded when the outbox table
-- has no publish_state / last_error / attempts columns (an application-managed
-- or Debezium-style table). With the default table, rejected rows are marked
-- FAILED in place instead and this table stays empty.
CREATE TABLE IF NOT EXISTS public.outbox_dead_letter (
    event_id   text        NOT NULL,
    event_type text,
    aggregate_type text,
    aggregate_id   text,
    envelope   text,
    reason     text        NOT NULL,
    failed_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS outbox_dead_letter_failed_idx ON public.outbox_dead_letter (failed_at);
GRANT SELECT, INSERT, DELETE ON public.outbox_dead_letter TO outbox_relay;
