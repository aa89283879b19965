//! Placeholder: the perfetto work writes the decoder and importer-rule checker here.
