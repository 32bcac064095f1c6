"""Small adapters between leancompile and trainers users already run (:mod:`.trl`)."""
