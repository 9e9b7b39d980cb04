// A whole kvferry conversation from Node.js over @grpc/grpc-js with the buf-generated client: two turns
// (the second reuses the first's KV), keep-alive, a look at what is retained, close. Errors arrive as
// gRPC status codes. tests/clients/test_node_client.py starts the router and runs this file; it passes
// the router's address, an API key and the model in KVFERRY_ROUTER_ADDRESS, KVFERRY_API_KEY and
// KVFERRY_MODEL.
import assert from "node:assert/strict";
import { after, test } from "node:test";

import { credentials, Metadata, status, type ServiceError } from "@grpc/grpc-js";

import {
  ChatMessage,
  ChatPrompt,
  type GenerateRequest,
  type GetConversationResponse,
  type RenewConversationResponse,
  ReuseDecision,
  RouterServiceClient,
  type TurnSummary,
} from "../src/index.js";

const address = required("KVFERRY_ROUTER_ADDRESS");
const apiKey = required("KVFERRY_API_KEY");
const model = required("KVFERRY_MODEL");

const client = new RouterServiceClient(address, credentials.createInsecure());
after(() => client.close());

function required(name: string): string {
  const value = process.env[name];
  if (!value) throw new Error(`set ${name}`);
  return value;
}

function auth(key: string = apiKey): Metadata {
  const metadata = new Metadata();
  metadata.set("authorization", `Bearer ${key}`);
  return metadata;
}

function deadline(seconds = 20): Date {
  return new Date(Date.now() + seconds * 1000);
}

interface Turn {
  text: string;
  tokenIds: bigint[];
  summary: TurnSummary;
}

// One Generate call: the streamed deltas joined, and the summary that ends the stream.
function generate(request: GenerateRequest, key?: string): Promise<Turn> {
  return new Promise((resolve, reject) => {
    const call = client.generate(request, auth(key), { deadline: deadline() });
    let text = "";
    const tokenIds: bigint[] = [];
    let summary: TurnSummary | undefined;
    call.on("data", (response) => {
      const event = response.event;
      if (event?.$case === "delta") {
        text += event.value.text;
        tokenIds.push(...event.value.tokenIds);
      } else if (event?.$case === "summary") {
        summary = event.value;
      }
    });
    call.on("error", reject);
    call.on("end", () =>
      summary ? resolve({ text, tokenIds, summary }) : reject(new Error("the stream ended without a summary")),
    );
  });
}

function renew(conversationId: string): Promise<RenewConversationResponse> {
  return new Promise((resolve, reject) =>
    client.renewConversation({ conversationId }, auth(), { deadline: deadline() }, (error, response) =>
      error ? reject(error) : resolve(response),
    ),
  );
}

function get(conversationId: string): Promise<GetConversationResponse> {
  return new Promise((resolve, reject) =>
    client.getConversation({ conversationId }, auth(), { deadline: deadline() }, (error, response) =>
      error ? reject(error) : resolve(response),
    ),
  );
}

function close(conversationId: string): Promise<void> {
  return new Promise((resolve, reject) =>
    client.closeConversation({ conversationId }, auth(), { deadline: deadline() }, (error) =>
      error ? reject(error) : resolve(),
    ),
  );
}

// Messages with only a role and content (the generated type also has the tool-call fields).
function say(role: string, content: string): ChatMessage {
  return ChatMessage.fromPartial({ role, content });
}

function chatTurn(conversationId: string, messages: ChatMessage[]): GenerateRequest {
  return {
    conversationId,
    model,
    prompt: { $case: "chat", value: ChatPrompt.fromPartial({ messages }) },
    sampling: { maxTokens: 12, temperature: 0, topP: 0, seed: 0n, stop: [], ignoreEos: true },
  };
}

async function rejectsWith(promise: Promise<unknown>, code: status): Promise<ServiceError> {
  try {
    await promise;
  } catch (error) {
    assert.equal((error as ServiceError).code, code, (error as ServiceError).details);
    return error as ServiceError;
  }
  assert.fail(`expected gRPC status ${status[code]}`);
}

test("a conversation: generate, reuse, keep alive, close", async () => {
  const conversationId = `node-${process.pid}-${Date.now()}`;
  const history: ChatMessage[] = [
    say("system", "You are a terse assistant. ".repeat(12)),
    say("user", "List three prime numbers."),
  ];

  const first = await generate(chatTurn(conversationId, history));
  assert.equal(first.summary.completionTokens, 12n);
  assert.equal(first.tokenIds.length, 12);
  assert.ok(first.text.length > 0);
  assert.equal(first.summary.reuse, ReuseDecision.REUSE_DECISION_NONE);
  assert.equal(first.summary.turn, 1n);

  // The agent runs a tool: keep the KV alive meanwhile.
  const renewed = await renew(conversationId);
  assert.ok(renewed.expireTime instanceof Date && renewed.expireTime.getTime() > Date.now());
  const retained = await get(conversationId);
  assert.equal(retained.turn, 1n);
  assert.equal(retained.engineId, first.summary.decodeEngineId);
  assert.ok(retained.numTokens >= first.summary.promptTokens);

  history.push(say("assistant", first.text), say("user", "And their sum?"));
  const second = await generate(chatTurn(conversationId, history));
  assert.equal(second.summary.reuse, ReuseDecision.REUSE_DECISION_PULL);
  assert.ok(second.summary.pulledTokens > 0n, "the second turn pulls the first turn's KV");
  assert.equal(second.summary.turn, 2n);

  await close(conversationId);
  await rejectsWith(get(conversationId), status.NOT_FOUND);
  await close(conversationId); // closing what is already gone succeeds
});

test("errors are gRPC status codes", async () => {
  const request = chatTurn(`node-errors-${process.pid}`, [say("user", "hi")]);
  await rejectsWith(generate(request, "not-a-key"), status.UNAUTHENTICATED);
  await rejectsWith(generate({ ...request, conversationId: "bad id" }), status.INVALID_ARGUMENT);
  await rejectsWith(generate({ ...request, model: "no-such-model" }), status.NOT_FOUND);
  await rejectsWith(renew("never-seen"), status.NOT_FOUND);
});
