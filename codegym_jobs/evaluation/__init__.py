"""Agent evaluation: any OpenAI-compatible model played through the runtime, and its records."""
