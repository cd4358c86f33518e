"""The engine (add_request / step / abort_request), its configuration, output processing and output types."""
