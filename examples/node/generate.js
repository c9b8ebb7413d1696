#!/usr/bin/env node
// Submit one prompt (token ids) to kvsched's RequestService.Generate and print the stream.
//
//   node generate.js [--server 127.0.0.1:50051] [--max-tokens 16] [--token BEARER] [ids...]
//
// Prints one line per message: "queued <id> on <instance>", "tokens <ids...>", and
// "finished <reason> prompt=<n> output=<n> cached=<n> ttft_s=<s>". Exits 0 when the request
// finished, 1 on an RPC error (with the status code and message on stderr).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

function parseArgs(argv) {
  const args = { server: "127.0.0.1:50051", maxTokens: 16, token: "", prompt: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--server") args.server = argv[++i];
    else if (a === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (a === "--token") args.token = argv[++i];
    else args.prompt.push(Number(a));
  }
  if (args.prompt.length === 0) args.prompt = [101, 2023, 2003, 1037, 3231, 102];
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

function main() {
  const args = parseArgs(process.argv.slice(2));
  const RequestService = loadService();
  const client = new RequestService(args.server, grpc.credentials.createInsecure());
  const metadata = new grpc.Metadata();
  if (args.token) metadata.set("authorization", `Bearer ${args.token}`);
  const call = client.Generate(
    {
      prompt_token_ids: args.prompt,
      sampling: { max_tokens: args.maxTokens, ignore_eos: true },
    },
    metadata,
  );
  let finished = false;
  call.on("data", (msg) => {
    if (msg.kind === "queued") {
      console.log(`queued ${msg.queued.request_id} on ${msg.queued.instance}`);
    } else if (msg.kind === "tokens") {
      console.log(`tokens ${msg.tokens.token_ids.join(" ")}`);
    } else if (msg.kind === "finished") {
      const f = msg.finished;
      finished = true;
      console.log(
        `finished ${f.reason} prompt=${f.usage.prompt_tokens} output=${f.usage.output_tokens} ` +
          `cached=${f.usage.cached_tokens} ttft_s=${f.timings.ttft_s.toFixed(4)}`,
      );
    }
  });
  call.on("error", (err) => {
    console.error(`error ${grpc.status[err.code]}: ${err.details}`);
    process.exitCode = 1;
  });
  call.on("end", () => {
    if (!finished && process.exitCode !== 1) process.exitCode = 1;
    client.close();
  });
}

main();
