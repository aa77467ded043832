// Debezium's embedded engine draining a backlog, for outbox-relay's bench
// (bench/src/debezium.rs compiles and runs it; docs/benchmarks.md).
//
//   java -cp 'libs/*:classes' DebeziumDrain <engine.properties> <records>
//
// The engine streams the slot named in the properties through pgoutput; the
// consumer counts the records (and the bytes of their JSON values, so the
// conversion cannot be skipped), marks every record processed and every batch
// finished through the committer, as a real consumer would, and the program
// exits once <records> have arrived. It prints one line on stdout:
//
//   debezium: engine=<class> records=<n> value_bytes=<b> first_s=<t> half_s=<t> all_s=<t>
//
// the times in seconds since the JVM started (its own start-up included, as
// a process measured from its spawn), at the first record, at records/2 and
// at the last.

import io.debezium.engine.ChangeEvent;
import io.debezium.engine.DebeziumEngine;
import io.debezium.engine.format.Json;

import java.io.FileInputStream;
import java.io.InputStream;
import java.lang.management.ManagementFactory;
import java.util.List;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.ExecutorService;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicReference;

public final class DebeziumDrain {
    private static final long JVM_START_MS = ManagementFactory.getRuntimeMXBean().getStartTime();

    private static double sinceStart() {
        return (System.currentTimeMillis() - JVM_START_MS) / 1000.0;
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 2) {
            System.err.println("usage: DebeziumDrain <engine.properties> <records>");
            System.exit(2);
        }
        Properties props = new Properties();
        try (InputStream in = new FileInputStream(args[0])) {
            props.load(in);
        }
        final long want = Long.parseLong(args[1]);
        final long half = Math.max(1, want / 2);
        final CountDownLatch done = new CountDownLatch(1);
        final AtomicReference<Throwable> failure = new AtomicReference<>();
        final double[] marks = new double[3]; // first, half, all
        final long[] seen = new long[2]; // records, value bytes

        DebeziumEngine.ChangeConsumer<ChangeEvent<String, String>> consumer =
            (List<ChangeEvent<String, String>> records,
             DebeziumEngine.RecordCommitter<ChangeEvent<String, String>> committer) -> {
                for (ChangeEvent<String, String> record : records) {
                    String value = record.value();
                    if (value != null) {
                        seen[1] += value.length();
                    }
                    long n = ++seen[0];
                    if (n == 1) {
                        marks[0] = sinceStart();
                    }
                    if (n == half) {
                        marks[1] = sinceStart();
                    }
                    if (n == want) {
                        marks[2] = sinceStart();
                        done.countDown();
                    }
                    committer.markProcessed(record);
                }
                committer.markBatchFinished();
            };

        DebeziumEngine<ChangeEvent<String, String>> engine = DebeziumEngine.create(Json.class)
            .using(props)
            .notifying(consumer)
            .using((boolean success, String message, Throwable error) -> {
                if (!success || error != null) {
                    failure.compareAndSet(null, error != null ? error : new RuntimeException(message));
                }
                // The engine stopped: whatever the count, nothing more comes.
                done.countDown();
            })
            .build();
        ExecutorService executor = Executors.newSingleThreadExecutor();
        executor.execute(engine);
        done.await();
        if (seen[0] < want) {
            System.err.println("debezium: the engine stopped after " + seen[0] + " of " + want + " records");
            Throwable error = failure.get();
            if (error != null) {
                error.printStackTrace();
            }
            System.exit(1);
        }
        System.out.printf(
            "debezium: engine=%s records=%d value_bytes=%d first_s=%.3f half_s=%.3f all_s=%.3f%n",
            engine.getClass().getName(), seen[0], seen[1], marks[0], marks[1], marks[2]);
        System.out.flush();
        // A bounded, orderly stop (the last offsets flushed); then exit, so a
        // slow shutdown cannot hold the measured process.
        Thread closer = new Thread(() -> {
            try {
                engine.close();
            } catch (Exception e) {
                System.err.println("debezium: close: " + e);
            }
        });
        closer.setDaemon(true);
        closer.start();
        closer.join(10_000);
        executor.shutdownNow();
        executor.awaitTermination(1, TimeUnit.SECONDS);
        System.exit(0);
    }
}
