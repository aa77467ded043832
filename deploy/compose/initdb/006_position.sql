-- `outbox-relay setup` output for the default names (table public.outbox,
-- publication and slot outbox_relay, role outbox_relay): sql/006_position.sql rendered,
-- for docker-compose.yml, whose postgres runs it on its first start
-- (/docker-entrypoint-initdb.d). Do not edit by hand: a test keeps what
-- follows this comment block equal to the relay's rendering, which
-- `outbox-relay --config deploy/compose/relay.toml setup` prints.

-- outbox-relay 006: the position the relay confirmed, kept on its side too.
-- PostgreSQL writes a slot's confirmed position to disk only at checkpoints
-- (before 17, only when other slot fields move too): after a crash or a fast
-- restart the slot can come back behind what the relay confirmed, and the
-- events in between would be published again. The relay writes its position
-- here (one row per slot, at most once per status interval and at a graceful
-- stop) and starts from the later of it and the slot's, unless the row was
-- written by another system, on another timeline or in another database, or
-- is ahead of the server's WAL: then the slot's position wins. Without this
-- table the relay starts from the slot, as PostgreSQL kept it.
CREATE TABLE IF NOT EXISTS public.outbox_position (
    slot_name         text        PRIMARY KEY,
    system_identifier text        NOT NULL,
    timeline          integer     NOT NULL,
    database_oid      oid         NOT NULL,
    confirmed_lsn     pg_lsn      NOT NULL,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    -- The derived lifecycle (lifecycle.on_published = "derive"): the snapshot
    -- the relay vouched for, its WAL position, when it was stored, and the
    -- spans no snapshot may vouch for (parallel arrays, from and to).
    snapshot          pg_snapshot,
    snapshot_lsn      pg_lsn,
    snapshot_at       timestamptz,
    hole_from         pg_snapshot[],
    hole_to           pg_snapshot[],
    -- What the publication sends of the table, as a session found it: a
    -- change (the table taken out and put back) opens a hole.
    publication_id    text
);
-- A table from before the derived lifecycle gets its columns (nullable: no
-- rewrite, a moment's lock).
ALTER TABLE public.outbox_position
    ADD COLUMN IF NOT EXISTS snapshot     pg_snapshot,
    ADD COLUMN IF NOT EXISTS snapshot_lsn pg_lsn,
    ADD COLUMN IF NOT EXISTS snapshot_at  timestamptz,
    ADD COLUMN IF NOT EXISTS hole_from    pg_snapshot[],
    ADD COLUMN IF NOT EXISTS hole_to      pg_snapshot[],
    ADD COLUMN IF NOT EXISTS publication_id text;
GRANT SELECT, INSERT, UPDATE ON public.outbox_position TO outbox_relay;
