"""Model families as specs (:mod:`.spec`), one module each, in one registry (:mod:`.registry`)."""
