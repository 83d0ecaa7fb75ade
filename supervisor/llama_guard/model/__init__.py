"""The model: types, inputs, actions, the transition record and the pure policy."""
