// Producer and worker processes of BullMQ (Node) for the throughput and latency
// benchmarks: the same line protocols as bench/children/peer_child.py and
// bench/children/mesh_child.py (see bench/_util.py).
//
//   node bullmq_driver.js MODULES produce --url URL --n N
//       enqueues N no-op jobs with one Queue.addBulk call (one MULTI of
//       BullMQ's add script per job, its fastest documented way), each with
//       removeOnComplete and removeOnFail (no record is kept, as trio-mesh
//       keeps none), and prints "enqueued <seconds>" (connection set-up not
//       included)
//   node bullmq_driver.js MODULES work --url URL --concurrency C
//       builds a Worker (autorun false, concurrency C, the no-op processor),
//       prints "ready", waits for "go" on stdin, then worker.run()
//   node bullmq_driver.js MODULES latency-work --url URL --concurrency C
//       a Worker (concurrency C) whose processor notes process.hrtime.bigint()
//       as it starts; prints "ready" once running. Answers "clock" with
//       "clock <hrtime ns>", "count" with "count <jobs started>" and "dump"
//       with one "latency <i> <ns>" line per started job (start - the enqueue
//       time in its data), then "end"
//   node bullmq_driver.js MODULES latency-produce --url URL --n N --rate R
//       prints "ready", waits for "go", then adds N jobs one Queue.add at a
//       time (removeOnComplete, removeOnFail) at R jobs/s on an absolute
//       schedule (job i is due at start + i / R, waited for with setTimeout),
//       each with data {i, t: <hrtime ns just before the call>}; prints
//       "enqueued <n> <first ns> <last ns>" (the first and last enqueue times)
//   node bullmq_driver.js MODULES version
//       prints "version <bullmq version> ioredis-<ioredis version>"
//
// MODULES is the folder bullmq was installed into (it holds
// node_modules/bullmq); the parent (bench/_node.py) installs it.
// process.hrtime.bigint() is libuv's uv_hrtime(): clock_gettime(CLOCK_MONOTONIC)
// on Linux, the clock of Python's time.monotonic_ns(), one for every process. Keys have
// BullMQ's default prefix "bull"; queue "bench". Only 127.0.0.1/localhost URLs.
"use strict";

const fs = require("fs");
const path = require("path");
const readline = require("readline");

const QUEUE = "bench";

function out(line) {
    process.stdout.write(line + "\n");
}

function arg(name, fallback) {
    const i = process.argv.indexOf(name);
    return i >= 0 ? process.argv[i + 1] : fallback;
}

function load(modules, name) {
    return require(path.join(modules, "node_modules", name));
}

function connection(url) {
    const u = new URL(url);
    const host = u.hostname;
    if (host !== "127.0.0.1" && host !== "localhost") {
        throw new Error(`only a redis-server on 127.0.0.1 is benchmarked, not ${host}`);
    }
    return { host, port: Number(u.port || 6379), maxRetriesPerRequest: null };
}

async function produce(modules, url, n) {
    const { Queue } = load(modules, "bullmq");
    const queue = new Queue(QUEUE, { connection: connection(url) });
    await queue.waitUntilReady();
    const opts = { removeOnComplete: true, removeOnFail: true };
    const jobs = [];
    for (let i = 0; i < n; i++) jobs.push({ name: "noop", data: i, opts });
    const t = process.hrtime.bigint();
    await queue.addBulk(jobs);
    const elapsed = Number(process.hrtime.bigint() - t) / 1e9;
    out(`enqueued ${elapsed.toFixed(6)}`);
    process.exit(0);
}

async function work(modules, url, concurrency) {
    const { Worker } = load(modules, "bullmq");
    const worker = new Worker(QUEUE, async () => {}, {
        connection: connection(url),
        concurrency,
        autorun: false,
    });
    worker.on("error", (err) => {
        process.stderr.write(`bullmq worker error: ${err}\n`);
    });
    await worker.waitUntilReady();
    out("ready");
    const rl = readline.createInterface({ input: process.stdin });
    rl.on("line", (line) => {
        if (line.trim() === "go") {
            worker.run().catch((err) => {
                process.stderr.write(`bullmq worker failed: ${err}\n`);
                process.exit(2);
            });
            out("started");
        }
    });
    rl.on("close", () => process.exit(0));
}

function lines(handler) {
    const rl = readline.createInterface({ input: process.stdin });
    rl.on("line", (line) => handler(line.trim()));
    rl.on("close", () => process.exit(0));
}

async function latencyWork(modules, url, concurrency) {
    const { Worker } = load(modules, "bullmq");
    const started = [];
    const worker = new Worker(
        QUEUE,
        async (job) => {
            started.push([process.hrtime.bigint(), job.data]);
        },
        { connection: connection(url), concurrency },
    );
    worker.on("error", (err) => {
        process.stderr.write(`bullmq worker error: ${err}\n`);
    });
    await worker.waitUntilReady();
    out("ready");
    lines((line) => {
        if (line === "clock") {
            out(`clock ${process.hrtime.bigint()}`);
        } else if (line === "count") {
            out(`count ${started.length}`);
        } else if (line === "dump") {
            const rows = started.map(([ns, data]) => `latency ${data.i} ${ns - BigInt(data.t)}`);
            rows.push("end");
            out(rows.join("\n"));
        }
    });
}

function sleep(ms) {
    return new Promise((resolve) => setTimeout(resolve, ms));
}

async function latencyProduce(modules, url, n, rate) {
    const { Queue } = load(modules, "bullmq");
    const queue = new Queue(QUEUE, { connection: connection(url) });
    await queue.waitUntilReady();
    const opts = { removeOnComplete: true, removeOnFail: true };
    out("ready");
    const go = await new Promise((resolve) => {
        const rl = readline.createInterface({ input: process.stdin });
        rl.once("line", (line) => {
            resolve(line.trim() === "go"); // before close(), which emits "close" at once
            rl.close();
        });
        rl.once("close", () => resolve(false));
    });
    if (!go) process.exit(0);
    const start = process.hrtime.bigint();
    let first = 0n;
    let last = 0n;
    for (let i = 0; i < n; i++) {
        const wait = Number(start + BigInt(Math.round((i * 1e9) / rate)) - process.hrtime.bigint());
        if (wait > 0) await sleep(wait / 1e6);
        last = process.hrtime.bigint();
        if (i === 0) first = last;
        await queue.add("noop", { i, t: last.toString() }, opts);
    }
    out(`enqueued ${n} ${first} ${last}`);
    process.exit(0);
}

function version(modules) {
    const read = (name) =>
        JSON.parse(
            fs.readFileSync(path.join(modules, "node_modules", name, "package.json"), "utf8"),
        ).version;
    load(modules, "bullmq"); // it loads
    out(`version ${read("bullmq")} ioredis-${read("ioredis")}`);
}

async function main() {
    const [modules, role] = process.argv.slice(2, 4);
    if (!modules || !role) {
        throw new Error("usage: node bullmq_driver.js MODULES produce|work|latency-work|latency-produce|version [options]");
    }
    if (role === "version") return version(modules);
    const url = arg("--url");
    if (!url) throw new Error("--url is required");
    if (role === "produce") return produce(modules, url, Number(arg("--n", "0")));
    if (role === "work") return work(modules, url, Number(arg("--concurrency", "10")));
    if (role === "latency-work") {
        return latencyWork(modules, url, Number(arg("--concurrency", "10")));
    }
    if (role === "latency-produce") {
        return latencyProduce(modules, url, Number(arg("--n", "0")), Number(arg("--rate", "500")));
    }
    throw new Error(`unknown role ${role}`);
}

main().catch((err) => {
    process.stderr.write(`${err && err.stack ? err.stack : err}\n`);
    process.exit(1);
});
