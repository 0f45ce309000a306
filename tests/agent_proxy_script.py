"""An agent in another process: the real `openai` SDK against relayrl's proxy (argv: base_url api_key mode)."""

import json
import sys

import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate arithmetic.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
        },
    }
]


def main(base_url: str, api_key: str, mode: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    seen: dict[str, object] = {}
    if mode == "errors":
        for name, kw in [
            ("top_logprobs", {"top_logprobs": 3}),  # without logprobs=true
            (
                "image",
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
            ),
        ]:
            try:
                client.chat.completions.create(model="p", **({"messages": [{"role": "user", "content": "hi"}]} | kw))
            except openai.BadRequestError as e:
                seen[name] = {"status": e.status_code, "message": e.message, "param": e.body.get("param")}
        try:
            openai.OpenAI(base_url=base_url, api_key="nope", max_retries=0).chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hi"}]
            )
        except openai.AuthenticationError as e:
            seen["auth"] = {"status": e.status_code, "message": e.message}
        print(json.dumps(seen))
        return
    messages = [{"role": "user", "content": "12+7="}]
    first = client.chat.completions.create(model="p", messages=messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    seen["call"] = [call.function.name, json.loads(call.function.arguments), first.choices[0].finish_reason]
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "19"},
    ]
    text, finish, pieces, usage = "", None, 0, None
    stream = client.chat.completions.create(
        model="p", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            pieces += bool(choice.delta.content)
            finish = choice.finish_reason or finish
    seen["answer"], seen["finish"], seen["pieces"] = text, finish, pieces
    seen["usage"] = usage.completion_tokens if usage else None
    if mode == "reward":
        seen["posted"] = client.post("/rewards", body={"reward": 0.75}, cast_to=object)
    print(json.dumps(seen))


if __name__ == "__main__":
    main(*sys.argv[1:4])
