#!/usr/bin/env node
// A front end that survives its daemon: Generate with a request id of its own, and when the
// stream breaks (UNAVAILABLE: the daemon was killed or restarts; the connection dropped), call
// RequestService.Resume with the tokens already received, retrying every 100 ms for up to
// --retry-s seconds. Every token is printed exactly once, then the finish.
//
//   node resume.js [--server 127.0.0.1:50051] [--max-tokens 64] [--id REQUEST_ID]
//                  [--retry-s 60] [--token BEARER] [ids...]
//
// Prints "queued <id>", "tokens <ids...>" per message, "resumed after <n> tokens" after each
// Resume, and "finished <reason> output=<n>". Exits 0 once finished, 1 on an error it cannot
// retry (e.g. NOT_FOUND: the request was never accepted and no journal knows it).
// Resume needs a daemon with a journal (`kvsched serve --cluster nats://... --daemon-id ID`),
// restarted under the same id; see docs/RELIABILITY.md.
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
  return args;
}

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

// One call (Generate, or Resume with the tokens held): resolves with "finished", or rejects with
// the gRPC error that broke it.
function follow(call, state) {
  return new Promise((resolve, reject) => {
    let finished = false;
    call.on("data", (msg) => {
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
    call.on("error", reject);
    call.on("end", () => (finished ? resolve() : reject(new Error("stream ended early"))));
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const RequestService = loadService();
  // Reconnect quickly: the default gRPC backoff starts at 1 s.
  const client = new RequestService(args.server, grpc.credentials.createInsecure(), {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
  });
  const metadata = new grpc.Metadata();
  if (args.token) metadata.set("authorization", `Bearer ${args.token}`);
  const state = { tokens: [], accepted: false };
  const deadline = Date.now() + args.retryS * 1000;
  let broken = false;
  for (;;) {
    let call;
    if (!broken) {
      call = client.Generate(
        {
          request_id: args.id,
          prompt_token_ids: args.prompt,
          sampling: { max_tokens: args.maxTokens, ignore_eos: true },
        },
        metadata,
      );
    } else {
      call = client.Resume({ request_id: args.id, token_ids: state.tokens }, metadata);
      console.log(`resumed after ${state.tokens.length} tokens`);
    }
    try {
      await follow(call, state);
      client.close();
      process.exitCode = 0;
      return;
    } catch (err) {
      const code = err.code;
      // Not found on Resume before any `queued`: the submit never got in; submit again.
      if (code === grpc.status.NOT_FOUND && broken && !state.accepted) {
        broken = false;
        continue;
      }
      const retry = code === grpc.status.UNAVAILABLE || code === grpc.status.CANCELLED ||
        code === undefined;
      if (!retry || Date.now() > deadline) {
        console.error(`error ${grpc.status[code]}: ${err.details || err.message}`);
        client.close();
        process.exitCode = 1;
        return;
      }
      broken = true;
      await sleep(100);
    }
  }
}

main();
