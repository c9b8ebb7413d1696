#!/usr/bin/env node
// A front end that survives its daemon, written from docs/CLIENT.md "Writing a client in another
// language": one channel per daemon with the page's options, Generate with a request id of its
// own (detachable), every attempt bounded to 2 s for its first answer, and when the stream breaks
// (UNAVAILABLE or CANCELLED, an end without `finished`, no first answer: the daemon was killed,
// restarts, or is paused) Resume with every token held at the next daemon of the list (round
// robin), 100 ms later, for up to --retry-s seconds. Every token is printed exactly once, then
// the finish.
//
//   node resume.js [--server HOST:PORT[,HOST:PORT...]] [--max-tokens 64] [--id REQUEST_ID]
//                  [--retry-s 60] [--token BEARER] [ids...]
//
// Prints "queued <id>", "tokens <ids...>" per message, "resumed after <n> tokens at <server>"
// before each Resume, and "finished <reason> output=<n>". Exits 0 once finished, 1 on an error
// it cannot retry (e.g. NOT_FOUND after `queued`: no journal knows the request).
// Resume needs daemons with a journal (`kvsched serve --cluster nats://... --daemon-id ID`): a
// daemon restarted under the same id, or any daemon of the cluster (it relays the Resume to the
// request's owner, or adopts the requests of one that died); see docs/RELIABILITY.md.
"use strict";

const path = require("path");
const crypto = require("crypto");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function parseArgs(argv) {
  const args = { server: "127.0.0.1:50051", maxTokens: 64, token: "", id: "", retryS: 60, prompt: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--server") args.server = argv[++i];
    else if (a === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (a === "--token") args.token = argv[++i];
    else if (a === "--id") args.id = argv[++i];
    else if (a === "--retry-s") args.retryS = Number(argv[++i]);
    else args.prompt.push(Number(a));
  }
  if (args.prompt.length === 0) args.prompt = [101, 2023, 2003, 1037, 3231, 102];
  if (!args.id) args.id = crypto.randomUUID();
  args.servers = args.server.split(",").filter((s) => s);
  return args;
}

// docs/CLIENT.md, rule 1: the channel options as gRPC core spells them. grpc-js honours the
// keepalive pair (it pings while a call is open, whatever the call sends, and needs no
// flow-control ping option) and the reconnect backoff; it ignores the names it does not know.
const CHANNEL_OPTIONS = {
  "grpc.keepalive_time_ms": 5000,
  "grpc.keepalive_timeout_ms": 2000,
  "grpc.http2.ping_timeout_ms": 2000,
  "grpc.http2.max_pings_without_data": 0,
  "grpc.keepalive_permit_without_calls": 0,
  "grpc.initial_reconnect_backoff_ms": 100,
  "grpc.min_reconnect_backoff_ms": 100,
  "grpc.max_reconnect_backoff_ms": 500,
};
const FIRST_ANSWER_MS = 2000; // rule 3: each attempt's first answer
const RETRY_BACKOFF_MS = 100; // rule 4: between two attempts

function loadService() {
  const protoRoot = path.resolve(__dirname, "..", "..", "protos");
  const def = protoLoader.loadSync("kvsched/v1/request_service.proto", {
    includeDirs: [protoRoot],
    keepCase: true,
    longs: Number,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(def).kvsched.v1.RequestService;
}

// One call (Generate, or Resume with the tokens held): resolves once `finished` came, rejects
// with the gRPC error that broke it, with UNAVAILABLE when its first answer (a message or a
// status) took over FIRST_ANSWER_MS (the call is cancelled), or when it ended without `finished`
// (a Resume elsewhere took the stream over).
function follow(call, state) {
  return new Promise((resolve, reject) => {
    let finished = false;
    let settled = false;
    const settle = (fn, v) => {
      if (!settled) {
        settled = true;
        clearTimeout(timer);
        fn(v);
      }
    };
    const timer = setTimeout(() => {
      settle(reject, { code: grpc.status.UNAVAILABLE, details: "no first answer" });
      call.cancel();
    }, FIRST_ANSWER_MS);
    call.on("data", (msg) => {
      clearTimeout(timer);
      if (msg.kind === "queued") {
        state.accepted = true;
        console.log(`queued ${msg.queued.request_id}`);
      } else if (msg.kind === "tokens") {
        state.tokens.push(...msg.tokens.token_ids);
        console.log(`tokens ${msg.tokens.token_ids.join(" ")}`);
      } else if (msg.kind === "finished") {
        finished = true;
        const f = msg.finished;
        console.log(`finished ${f.reason} output=${f.usage.output_tokens}`);
      }
    });
    call.on("error", (err) => settle(reject, err));
    call.on("end", () =>
      finished
        ? settle(resolve)
        : settle(reject, { code: grpc.status.UNAVAILABLE, details: "stream ended early" }),
    );
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const RequestService = loadService();
  const creds = grpc.credentials.createInsecure();
  const clients = args.servers.map((s) => new RequestService(s, creds, CHANNEL_OPTIONS));
  const metadata = new grpc.Metadata();
  if (args.token) metadata.set("authorization", `Bearer ${args.token}`);
  const state = { tokens: [], accepted: false };
  const closeAll = () => clients.forEach((c) => c.close());
  let i = 0; // the daemon of this attempt
  let resume = false; // the next attempt is a Resume (rule 4), not a Generate
  let giveUp = null; // set at the first failure of a break (rule 4: 60 s)
  for (;;) {
    let call;
    if (!resume) {
      call = clients[i].Generate(
        {
          request_id: args.id,
          prompt_token_ids: args.prompt,
          sampling: { max_tokens: args.maxTokens, ignore_eos: true },
          detachable: true,
        },
        metadata,
      );
    } else {
      call = clients[i].Resume({ request_id: args.id, token_ids: state.tokens }, metadata);
      console.log(`resumed after ${state.tokens.length} tokens at ${args.servers[i]}`);
    }
    const got = state.tokens.length;
    try {
      await follow(call, state);
      closeAll();
      process.exitCode = 0;
      return;
    } catch (err) {
      const code = err.code;
      const live = (err.metadata ? err.metadata.get("kvsched-error") : []).map(String);
      // Rule 5: refused as already live: an earlier attempt was accepted after all.
      if (code === grpc.status.INVALID_ARGUMENT && !resume && live.includes("RequestAlreadyLive")) {
        resume = true;
        continue;
      }
      // Rule 5: Resume NOT_FOUND before any `queued`: the submit never got in; submit again.
      if (code === grpc.status.NOT_FOUND && resume && !state.accepted) {
        resume = false;
        continue;
      }
      const retry = code === grpc.status.UNAVAILABLE || code === grpc.status.CANCELLED;
      if (state.tokens.length > got) giveUp = null; // it delivered: a new break starts
      if (giveUp === null) giveUp = Date.now() + args.retryS * 1000;
      if (!retry || Date.now() > giveUp) {
        console.error(`error ${grpc.status[code]}: ${err.details || err.message}`);
        closeAll();
        process.exitCode = 1;
        return;
      }
      resume = true; // rule 4 (a Generate that got no first answer may have been accepted)
      i = (i + 1) % clients.length;
      await sleep(RETRY_BACKOFF_MS);
    }
  }
}

main();
