"""Chat formats, below both front ends (the offline `LLM.chat` and the server): rendering a
conversation with the model's chat template (template.py), the messages of a conversation given
as OpenAI's dicts (turns.py), and the models' tool-call formats (tool_parsers/, by vLLM's
`--tool-call-parser` names). Pure Python; never imports the engine or the server."""
