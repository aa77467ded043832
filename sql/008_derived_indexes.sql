-- outbox-relay 008: the derived lifecycle's indexes on a table from before it,
-- built without blocking writes (a table 001 created has them already; a
-- table without publish_state and an xid8 relay_txid is left alone).
--
-- CREATE INDEX CONCURRENTLY cannot run in a transaction, so this file is a
-- query that returns the statements still to run, in order, each to run on
-- its own: `setup --apply` runs them, and so does psql (\gexec). It returns
-- none when every index is in place, so running it again is harmless.
--   * <table>_txid_idx: the rows whose state is derived (they stay PENDING);
--   * <table>_explicit_idx: the poller's rows (FAILED, and PENDING without
--     an id), which replaces <table>_due_idx: that one is dropped (also
--     CONCURRENTLY) once its successor is built;
--   * <table>_published_idx, should it be missing.
-- An index left invalid by an interrupted build is dropped and built again.
-- A partitioned table cannot build an index concurrently: its index is made on
-- the parent alone (ON ONLY: no data, a moment's SHARE lock), each partition's
-- is built concurrently and attached; the old partitioned due index is dropped
-- under a moment's ACCESS EXCLUSIVE lock. Those locks are waited for at most
-- {{'lock_timeout'}}: when the wait is cut short, run setup --apply again once
-- the long transaction has finished.
WITH outbox AS (
    SELECT c.oid, c.relkind
      FROM pg_class c
     WHERE c.oid = to_regclass({{'table_regclass'}})
       AND EXISTS (SELECT 1 FROM pg_attribute
                    WHERE attrelid = c.oid AND attname = 'publish_state' AND NOT attisdropped)
       AND EXISTS (SELECT 1 FROM pg_attribute
                    WHERE attrelid = c.oid AND attname = 'relay_txid' AND NOT attisdropped
                      AND atttypid = 'xid8'::regtype)
), wanted (step, name, suffix, definition) AS (VALUES
    (1, {{'table_txid_index'}}, '_txid_idx',
        format('(relay_txid) WHERE publish_state = %L', 'PENDING')),
    (2, {{'table_explicit_index'}}, '_explicit_idx',
        format('(%I) WHERE publish_state = %L OR (publish_state = %L AND relay_txid IS NULL)',
               {{'col_created_at'}}, 'FAILED', 'PENDING')),
    (3, {{'table_published_index'}}, '_published_idx',
        format('(published_at) WHERE publish_state IN (%L, %L)', 'PUBLISHED', 'SKIPPED'))
), wanted_index AS (
    SELECT w.*, o.oid AS rel, o.relkind, i.indexrelid, coalesce(i.indisvalid, false) AS valid
      FROM outbox o CROSS JOIN wanted w
      LEFT JOIN pg_index i ON i.indexrelid = to_regclass(format('%I.%I', {{'schema'}}, w.name))
), part_missing AS (
    -- The partitions whose index is not attached to the parent's yet.
    SELECT x.*, c.relname::text AS part, n.nspname::text AS part_schema,
           c.relname || x.suffix AS part_index,
           pi.indexrelid AS part_indexrelid, coalesce(pi.indisvalid, false) AS part_valid
      FROM wanted_index x
      JOIN pg_inherits h ON h.inhparent = x.rel
      JOIN pg_class c ON c.oid = h.inhrelid AND c.relkind = 'r'
      JOIN pg_namespace n ON n.oid = c.relnamespace
      LEFT JOIN pg_index pi ON pi.indexrelid = to_regclass(format('%I.%I', n.nspname, c.relname || x.suffix))
     WHERE x.relkind = 'p' AND NOT x.valid
       AND NOT EXISTS (SELECT 1 FROM pg_inherits ih JOIN pg_index ci ON ci.indexrelid = ih.inhrelid
                        WHERE ih.inhparent = x.indexrelid AND ci.indrelid = c.oid)
), waits AS (
    SELECT format('SELECT set_config(%L, %L, true); ', 'lock_timeout', {{'lock_timeout'}}) AS wait
)
SELECT statement FROM (
    SELECT step, '' AS part, 1 AS sub,
           format('DROP INDEX CONCURRENTLY IF EXISTS %I.%I', {{'schema'}}, name) AS statement
      FROM wanted_index WHERE relkind = 'r' AND indexrelid IS NOT NULL AND NOT valid
    UNION ALL
    SELECT step, '', 2, format('CREATE INDEX CONCURRENTLY IF NOT EXISTS %I ON %I.%I %s',
                               name, {{'schema'}}, {{'table'}}, definition)
      FROM wanted_index WHERE relkind = 'r' AND NOT valid
    UNION ALL
    SELECT step, '', 1, wait || format('CREATE INDEX IF NOT EXISTS %I ON ONLY %I.%I %s',
                                       name, {{'schema'}}, {{'table'}}, definition)
      FROM wanted_index, waits WHERE relkind = 'p' AND indexrelid IS NULL
    UNION ALL
    SELECT step, part, 2, format('DROP INDEX CONCURRENTLY IF EXISTS %I.%I', part_schema, part_index)
      FROM part_missing WHERE part_indexrelid IS NOT NULL AND NOT part_valid
    UNION ALL
    SELECT step, part, 3, format('CREATE INDEX CONCURRENTLY IF NOT EXISTS %I ON %I.%I %s',
                                 part_index, part_schema, part, definition)
      FROM part_missing WHERE NOT part_valid
    UNION ALL
    SELECT step, part, 4, wait || format('ALTER INDEX %I.%I ATTACH PARTITION %I.%I',
                                         {{'schema'}}, name, part_schema, part_index)
      FROM part_missing, waits
    UNION ALL
    SELECT 4, '', 1, CASE o.relkind
                WHEN 'r' THEN format('DROP INDEX CONCURRENTLY IF EXISTS %I.%I', {{'schema'}}, {{'table_due_index'}})
                ELSE (SELECT wait FROM waits) || format('DROP INDEX IF EXISTS %I.%I', {{'schema'}}, {{'table_due_index'}})
             END
      FROM outbox o
     WHERE to_regclass(format('%I.%I', {{'schema'}}, {{'table_due_index'}})) IS NOT NULL
) s
ORDER BY step, part, sub
\gexec
