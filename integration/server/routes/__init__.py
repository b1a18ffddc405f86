"""The app's endpoints, a router per family: completions, chat, tokenize, models, admin."""
