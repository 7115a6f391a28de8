"""The serving side: engine loop + scheduler (native backend), later the HTTP app."""
