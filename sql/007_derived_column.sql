-- outbox-relay 007: the derived lifecycle's column on a table from before it
-- (a table 001 created has it already; a table without the relay-managed
-- publish_state is left alone: it runs lifecycle.on_published = "none").
--
-- Two statements, never `ADD COLUMN ... DEFAULT pg_current_xact_id()` in one:
-- that takes PostgreSQL's fast-default path and stamps every existing row with
-- this transaction's id, and PENDING rows would read as published once the
-- relay vouches for a snapshot after it. Added without a default, old rows
-- keep NULL (their explicit publish_state, as before); the default then fills
-- the column for new rows. Both change the catalog only (no rewrite) under a
-- moment's ACCESS EXCLUSIVE lock; waiting for it behind a long transaction
-- would queue every insert behind this one, so the wait is cut short
-- (lock_timeout) and nothing is changed: run setup --apply again once the
-- transaction named in the error has finished.
DO $$
DECLARE
    outbox    regclass := to_regclass({{'table_regclass'}});
    holders   text;
BEGIN
    IF outbox IS NULL OR NOT EXISTS (
        SELECT 1 FROM pg_attribute
        WHERE attrelid = outbox AND attname = 'publish_state' AND NOT attisdropped
    ) THEN
        RETURN;
    END IF;
    IF EXISTS (
        SELECT 1 FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = outbox AND a.attname = 'relay_txid' AND NOT a.attisdropped
          AND (a.atttypid <> 'xid8'::regtype
               OR pg_get_expr(d.adbin, d.adrelid) IS NOT DISTINCT FROM 'pg_current_xact_id()')
    ) THEN
        -- Migrated already (or the column is not the relay's: check says so).
        RETURN;
    END IF;
    PERFORM set_config('lock_timeout', {{'lock_timeout'}}, true);
    BEGIN
        ALTER TABLE {{schema}}.{{table}} ADD COLUMN IF NOT EXISTS relay_txid xid8;
        ALTER TABLE {{schema}}.{{table}} ALTER COLUMN relay_txid SET DEFAULT pg_current_xact_id();
    EXCEPTION WHEN lock_not_available THEN
        SELECT string_agg(format('PID %s (%s, in a transaction since %s: %s)', l.pid, l.mode,
                                 a.xact_start, left(a.query, 60)), '; ')
          INTO holders
          FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
         WHERE l.relation = outbox AND l.granted AND l.pid <> pg_backend_pid();
        RAISE lock_not_available USING
            MESSAGE = format('adding relay_txid to %s waited %s for its lock; nothing was changed',
                             outbox, current_setting('lock_timeout')),
            DETAIL = format('Holding locks on the table: %s.', coalesce(holders, 'none any more')),
            HINT = 'Run setup --apply again once that transaction has finished (or end it: SELECT pg_terminate_backend(PID)).';
    END;
END
$$;
