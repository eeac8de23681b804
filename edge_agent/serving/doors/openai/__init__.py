"""OpenAI's request and response shapes: what the HTTP API parses and writes, and the tools a voice turn uses."""
