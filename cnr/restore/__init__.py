"""Reading a checkpoint back: the newest restorable one, into an app, a chain, pieces, verification, load_state_dict."""
