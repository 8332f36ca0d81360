"""Models leaving the framework: the CTranslate2 export (`export`) and translating with one (`exported`)."""
