// Producer and worker processes of Worqr (Node) for the throughput benchmark:
// the same line protocol as bench/_peer_child.py (see bench/_util.py).
//
//   node worqr_driver.js MODULES produce --url URL --n N
//       enqueues N no-op tasks with one enqueue(queue, tasks) call (one LPUSH
//       of all of them in a MULTI, Worqr's fastest documented way) and prints
//       "enqueued <seconds>" (connection set-up not included)
//   node worqr_driver.js MODULES work --url URL --concurrency C
//       starts the worker (startWorker), prints "ready", waits for "go" on
//       stdin, then startWork(queue): every 'work' event starts loops until C
//       run; each loop dequeues a process, runs the no-op handler, awaits
//       finishProcess, and goes on until dequeue finds the queue empty
//       (Worqr's readme's doWork, C of them at once)
//   node worqr_driver.js MODULES version
//       prints "version <worqr version> redis-<node redis client version>"
//
// MODULES is the folder the Worqr tarball was installed into (it holds
// node_modules/worqr); the parent (bench/worqr.py) installs it. Keys are
// prefixed "worqr-bench"; queue "bench". Only 127.0.0.1/localhost URLs.
"use strict";

const path = require("path");
const readline = require("readline");

const QUEUE = "bench";
const PREFIX = "worqr-bench";

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

function makeWorqr(modules, url) {
    const { Worqr } = load(modules, "worqr");
    const u = new URL(url);
    const host = u.hostname;
    if (host !== "127.0.0.1" && host !== "localhost") {
        throw new Error(`only a redis-server on 127.0.0.1 is benchmarked, not ${host}`);
    }
    const w = new Worqr({ host, port: Number(u.port || 6379) }, { redisKeyPrefix: PREFIX });
    w.on("error", (err) => {
        process.stderr.write(`worqr error: ${err}\n`);
        process.exit(2);
    });
    return w;
}

async function produce(modules, url, n) {
    const w = makeWorqr(modules, url);
    const tasks = [];
    for (let i = 0; i < n; i++) tasks.push(String(i));
    await w.countQueue(QUEUE); // connected
    const t = process.hrtime.bigint();
    await w.enqueue(QUEUE, tasks);
    const elapsed = Number(process.hrtime.bigint() - t) / 1e9;
    out(`enqueued ${elapsed.toFixed(6)}`);
    process.exit(0);
}

async function noop(task) {}

async function work(modules, url, concurrency) {
    const w = makeWorqr(modules, url);
    await w.startWorker();
    let running = 0;

    async function loop() {
        try {
            for (;;) {
                const p = await w.dequeue(QUEUE);
                if (!p) return;
                await noop(p.task);
                await w.finishProcess(p.id);
            }
        } finally {
            running--;
        }
    }

    function kick() {
        while (running < concurrency) {
            running++;
            loop().catch((err) => {
                process.stderr.write(`worqr loop failed: ${err}\n`);
                process.exit(2);
            });
        }
    }

    w.on(QUEUE, (type) => {
        if (type === "work") kick();
    });
    out("ready");
    const rl = readline.createInterface({ input: process.stdin });
    rl.on("line", async (line) => {
        if (line.trim() === "go") {
            await w.startWork(QUEUE);
            // startWork publishes a 'work' event if tasks are queued, but its
            // subscription is on another connection and may not be active
            // yet: look once ourselves as well
            kick();
            out("started");
        }
    });
    rl.on("close", () => process.exit(0));
}

function version(modules) {
    const worqr = load(modules, "worqr/package.json").version;
    const redis = load(modules, "redis/package.json").version;
    out(`version ${worqr} redis-${redis}`);
}

async function main() {
    const [modules, role] = process.argv.slice(2, 4);
    if (!modules || !role) {
        throw new Error("usage: node worqr_driver.js MODULES produce|work|version [options]");
    }
    if (role === "version") return version(modules);
    const url = arg("--url");
    if (!url) throw new Error("--url is required");
    if (role === "produce") return produce(modules, url, Number(arg("--n", "0")));
    if (role === "work") return work(modules, url, Number(arg("--concurrency", "10")));
    throw new Error(`unknown role ${role}`);
}

main().catch((err) => {
    process.stderr.write(`${err && err.stack ? err.stack : err}\n`);
    process.exit(1);
});
