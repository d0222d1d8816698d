"""Moving tensors between ranks and hearing failures: a rank's messages and bounded waits (messenger), one step's
messages (step_messages), the backend's transport (transport), helper threads (threads), the failure watch (watch)
and packed gradient messages (packed)."""
