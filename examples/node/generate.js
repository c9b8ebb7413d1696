#!/usr/bin/env node
// Submit one prompt (token ids) to kvsched's RequestService.Generate and print the stream.
//
//   node generate.js [--server 127.0.0.1:50051] [--max-tokens 16] [--token BEARER] [ids...]
//
// Prints one line per message: "queued <id> on <instance>", "tokens <ids...>", and
// "finished <reason> prompt=<n> output=<n> cached=<n> ttft_s=<s>". Exits 0 when the request
// finished, 1 on an RPC error (with the status code and message on stderr).
//
// Tracing: the call runs inside an OpenTelemetry client span whose context goes to the daemon as
// a W3C `traceparent` in the gRPC metadata, so kvsched's request span is this span's child in
// the same trace. With OTEL_EXPORTER_OTLP_ENDPOINT set (e.g. http://127.0.0.1:4317), the span is
// exported there over OTLP/gRPC; stderr gets "trace <trace id> span <span id>".
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const otel = require("@opentelemetry/api");
const { W3CTraceContextPropagator } = require("@opentelemetry/core");
const { resourceFromAttributes } = require("@opentelemetry/resources");
const { BasicTracerProvider, BatchSpanProcessor } = require("@opentelemetry/sdk-trace-base");
const { OTLPTraceExporter } = require("@opentelemetry/exporter-trace-otlp-grpc");

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

// A tracer provider of this process. Spans are always created (the daemon needs a real trace
// context to join), and exported only when an OTLP endpoint is configured.
function makeTracerProvider() {
  const spanProcessors = [];
  if (process.env.OTEL_EXPORTER_OTLP_ENDPOINT || process.env.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) {
    // The exporter reads the endpoint (and OTEL_EXPORTER_OTLP_HEADERS) from the environment.
    spanProcessors.push(new BatchSpanProcessor(new OTLPTraceExporter()));
  }
  return new BasicTracerProvider({
    resource: resourceFromAttributes({
      "service.name": process.env.OTEL_SERVICE_NAME || "kvsched-node-example",
    }),
    spanProcessors,
  });
}

function generate(client, args, span) {
  const metadata = new grpc.Metadata();
  if (args.token) metadata.set("authorization", `Bearer ${args.token}`);
  // traceparent (and tracestate) from the span's context, into the call's metadata.
  const carrier = {};
  const ctx = otel.trace.setSpan(otel.ROOT_CONTEXT, span);
  new W3CTraceContextPropagator().inject(ctx, carrier, otel.defaultTextMapSetter);
  for (const [key, value] of Object.entries(carrier)) metadata.set(key, value);

  return new Promise((resolve) => {
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
        span.setAttribute("kvsched.request_id", msg.queued.request_id);
      } else if (msg.kind === "tokens") {
        console.log(`tokens ${msg.tokens.token_ids.join(" ")}`);
      } else if (msg.kind === "finished") {
        const f = msg.finished;
        finished = true;
        span.setAttribute("kvsched.finish_reason", f.reason);
        console.log(
          `finished ${f.reason} prompt=${f.usage.prompt_tokens} output=${f.usage.output_tokens} ` +
            `cached=${f.usage.cached_tokens} ttft_s=${f.timings.ttft_s.toFixed(4)}`,
        );
      }
    });
    call.on("error", (err) => {
      console.error(`error ${grpc.status[err.code]}: ${err.details}`);
      span.setAttribute("rpc.grpc.status_code", err.code);
      span.setStatus({ code: otel.SpanStatusCode.ERROR, message: err.details });
      resolve(1);
    });
    call.on("end", () => resolve(finished ? 0 : 1));
  });
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const RequestService = loadService();
  const client = new RequestService(args.server, grpc.credentials.createInsecure());
  const provider = makeTracerProvider();
  const tracer = provider.getTracer("kvsched-node-example", "0.1.0");
  // Named and shaped as the OpenTelemetry RPC conventions say for a gRPC client call.
  const span = tracer.startSpan("kvsched.v1.RequestService/Generate", {
    kind: otel.SpanKind.CLIENT,
    attributes: {
      "rpc.system": "grpc",
      "rpc.service": "kvsched.v1.RequestService",
      "rpc.method": "Generate",
      "server.address": args.server,
    },
  });
  const sc = span.spanContext();
  console.error(`trace ${sc.traceId} span ${sc.spanId}`);
  try {
    process.exitCode = await generate(client, args, span);
  } finally {
    span.end();
    client.close();
    await provider.shutdown(); // flushes the span to the exporter before the process exits
  }
}

main();
